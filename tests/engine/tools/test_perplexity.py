"""`hivejet perplexity` against llama.cpp's reference outputs (ctx 256, 6 chunks), both real models.

Limits from the engine-core issue: PPL within 1% of llama.cpp's, mean KLD at most 0.01, same top
token at least 95% (llama.cpp against itself with another batch size: ~0.004-0.006 and 96-97%).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from app.cli import main
from engine.gguf.reader import GGUFFile
from engine.tools.perplexity import make_chunks
from engine.tokenizer import Tokenizer

LLAMA_CPP_PPL = {("smollm2", "gpl3"): 19.4707, ("smollm2", "heapq_py"): 25.8065,
                 ("gemma3", "gpl3"): 15.6999, ("gemma3", "heapq_py"): 27.4934}
CASES = sorted(LLAMA_CPP_PPL)


@pytest.mark.parametrize("model,text", CASES)
def test_chunks_equal_llamacpp(model, text, model_paths, reference_dir):
    """Our tokenization + chunking of the text gives llama.cpp's evaluated chunks."""
    base = np.load(reference_dir / f"{model}.{text}.top64.npz")
    f = GGUFFile(model_paths[model])
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    ids = tok.encode((reference_dir / "texts" / f"{text}.txt").read_text(encoding="utf-8"))
    chunks = make_chunks(ids, 256, 6, None)
    assert np.array_equal(chunks, base["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("model,text", CASES)
def test_perplexity_matches_llamacpp(model, text, model_paths, reference_dir, capsys):
    rc = main(["perplexity", "-m", str(model_paths[model]), "-f", str(reference_dir / "texts" / f"{text}.txt"),
               "-c", "256", "--chunks", "6", "-b", "256",
               "--kl-divergence-base", str(reference_dir / f"{model}.{text}.top64.npz")])
    out = capsys.readouterr().out
    assert rc == 0, out
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))
    kld = float(re.search(r"Mean\s+KLD:\s+([0-9.]+)", out).group(1))
    same = float(re.search(r"Same top p:\s+([0-9.]+)", out).group(1))
    ref = LLAMA_CPP_PPL[(model, text)]
    print(f"{model} {text}: PPL {ppl:.4f} (llama.cpp {ref}), KLD {kld:.6f}, same top {same:.3f}%")
    assert abs(ppl / ref - 1) < 0.01
    assert kld <= 0.01
    assert same >= 95.0


def test_perplexity_llamacpp_binary_base(tmp_path, smollm2_path, reference_dir):
    """llama.cpp's binary --kl-divergence-base format is read too: write one from the npz's top-64
    (the rest of the vocabulary at the -16 floor llama.cpp ignores) and compare one chunk."""
    from engine.models import open_model
    from engine.tools.perplexity import load_base, perplexity
    d = np.load(reference_dir / "smollm2.gpl3.top64.npz")
    n_ctx, n_vocab, n_chunk = 256, 49152, 1
    first = n_ctx // 2
    rows = n_ctx - 1 - first
    nv = 2 * ((n_vocab + 1) // 2) + 4
    logp = np.full((rows, n_vocab), -30.0, np.float32)
    for r in range(rows):
        logp[r, d["top_ids"][r]] = d["top_logprobs"][r]
    mx = logp.max(1, keepdims=True)
    mn = np.maximum(logp.min(1, keepdims=True), mx - 16)
    scale = (mx - mn) / 65535.0
    packed = np.zeros((rows, nv), np.uint16)
    packed[:, :4] = np.concatenate([scale, mn], 1).astype(np.float32).view(np.uint16)
    packed[:, 4:4 + n_vocab] = np.where(logp > mn, np.rint((logp - mn) / scale), 0).astype(np.uint16)
    p = tmp_path / "base.kld"
    with open(p, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
        f.write(d["tokens"][:1].astype(np.int32).tobytes())
        f.write(packed.tobytes())
    base = load_base(p)
    assert base.full_logprobs.shape == (rows, n_vocab)
    m = open_model(smollm2_path)
    tok = Tokenizer.from_metadata(m.file.metadata)
    res = perplexity(m, tok, base=base, n_batch=256)
    m.close()
    assert res.kld_mean < 0.05 and res.same_top > 0.9


def test_perplexity_text_too_short(smollm2_path, tmp_path, capsys):
    f = tmp_path / "short.txt"
    f.write_text("too short")
    assert main(["perplexity", "-m", str(smollm2_path), "-f", str(f), "-c", "256"]) == 1
    assert "need at least 512 tokens" in capsys.readouterr().err
