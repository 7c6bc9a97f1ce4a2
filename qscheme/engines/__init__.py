"""What serving engines make of a qscheme checkpoint, as data and pure functions: no engine is
imported here (``import qscheme`` never imports vLLM). ``vllm_layers``: how vLLM groups a
checkpoint's modules into its layers; ``vllm_builtin``: vLLM's own method for each scheme."""
