"""Models: the model layer of the core. It owns turning model names into local folders
(``resolve``: the model registry, the offline SmolLM2 preparation, fingerprints, the
model-load lock) and the embedder (``embedding``, with its ONNX Runtime backend in
``embedding_onnx``). The package imports nothing: import the module you need."""
