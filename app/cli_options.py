"""Options that chat, generate and serve share, defined once so app/cli.py and app/server cannot drift apart."""
from __future__ import annotations

import argparse


def _spec_mode(value: str) -> str:
    return "off" if value == "none" else value      # "none": an accepted spelling of "off"


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """--spec, --spec-drafter and --host-sampling: speculative decoding and the GPU path's sampling."""
    from engine.spec import SPEC_MODES
    p.add_argument("--spec", default="off", type=_spec_mode, choices=list(SPEC_MODES),
                   help="speculative decoding (exact output at any temperature; CPU and GPU alike): ngram drafts from the "
                        "conversation (prompt lookup), mtp (Qwen3.5/3.6's own MTP block), dflash (a DFlash "
                        "drafter, --spec-drafter), or a chain mtp+ngram / dflash+ngram (n-gram drafts when the "
                        "conversation repeats a long span)")
    p.add_argument("--spec-drafter", default=None, metavar="PATH",
                   help="the DFlash drafter for --spec dflash: a directory with config.json + model.safetensors "
                        "(as z-lab publishes them) or its GGUF port")
    p.add_argument("--host-sampling", action="store_true",
                   help="GPU path: choose every token on the host from full logits and run steps one after "
                        "another (no device-side sampling, no step overlap): for diagnosing the GPU path")
