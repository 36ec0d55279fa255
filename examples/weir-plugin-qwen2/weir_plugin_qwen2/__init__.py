"""An example third-party Weir plugin adding the Qwen2 architecture (``Qwen2ForCausalLM``)."""
