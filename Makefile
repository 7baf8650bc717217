# `make test` and `make demo` do all the set-up themselves on a fresh machine.
VENV  := .venv
STAMP := $(VENV)/.inferscale-installed

.PHONY: test demo install clean

$(STAMP): pyproject.toml scripts/install.sh integrations/llama_index/examples/server-client-requirements.txt \
        integrations/mem0/examples/client-requirements.txt
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/inferscale demo

clean:
	rm -rf $(VENV) .venv-llamaindex-client .venv-mem0-client .pytest_cache
