"""Runtime: process-wide plumbing of the core, shared with vLLM's engine process. It owns
devices and dtypes by name (``devices``), default sizes in bytes (``sizes``), quiet-by-default
logging for the engines we start (``logs``) and closing what is still open at exit
(``lifecycle``). vLLM's engine process loads the KV connector, which imports ``devices``
and ``sizes`` from here, so this package imports nothing and stays small."""
