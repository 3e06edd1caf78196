"""Reading GGUF files: metadata, tensors, and the model description built from them."""
