"""Speculative decoding: drafters propose tokens, the target model verifies them in the shared step."""

# EngineConfig.spec: one drafter, or a model drafter chained with n-gram lookup (kept here, free of torch,
# for the command line)
SPEC_MODES = ("off", "ngram", "mtp", "dflash", "mtp+ngram", "dflash+ngram")
