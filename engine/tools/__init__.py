"""What measures or makes things: benchmarks (decode, spec, agents, vision, with llama.cpp beside), synthetic GGUF
writers, perplexity and KV-quality measurements, the passkey test and codebook training. The runtime modules
(engine, runner, scheduler, models, kernels) never import from here; the `hivejet` command and the tests do."""
