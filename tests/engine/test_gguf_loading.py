"""GGUF loading: our reader agrees with the gguf package, and every broken file gives one clear
error naming the file and the problem, with nothing left mapped."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.gguf.reader import GGUFError, GGUFFile
from engine.models import open_model


def _mapped(path: Path) -> bool:
    gc.collect()
    target = str(path.resolve())
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(target) for line in f)


def _write(path: Path, arch: str = "llama", tensors=None, extra_kv=None) -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_feed_forward_length(64)
    w.add_context_length(128)
    w.add_token_list([f"t{i}" for i in range(16)])
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v)
    for name, arr, raw_dtype in tensors or [("token_embd.weight", np.zeros((16, 32), np.float32), None)]:
        if raw_dtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_matches_gguf_package(smollm2_path):
    ours = GGUFFile(smollm2_path)
    ref = GGUFReader(smollm2_path)
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(int(x) for x in reversed(t.shape))
        assert mine.offset == t.data_offset and mine.n_bytes == t.n_bytes
        assert np.array_equal(np.asarray(ours.tensor_bytes(t.name)), np.asarray(t.data).view(np.uint8).reshape(-1))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        val = field.contents()
        assert ours.metadata[key] == pytest.approx(val) if isinstance(val, float) else ours.metadata[key] == val, key
    ours.close()


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="file not found") as e:
        open_model(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)


def test_directory(tmp_path):
    with pytest.raises(GGUFError, match="not a regular file"):
        open_model(tmp_path)


def test_bad_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + os.urandom(100))
    with pytest.raises(GGUFError, match="bad magic") as e:
        open_model(p)
    assert str(p) in str(e.value)
    assert not _mapped(p)


def test_tiny_file(tmp_path):
    p = tmp_path / "tiny.gguf"
    p.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(GGUFError, match="truncated"):
        open_model(p)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.9, 0.999])
def test_truncated_file(tmp_path, smollm2_path, keep):
    """Cut the real model short anywhere: header, tensor index or tensor data."""
    data = smollm2_path.read_bytes()
    n = int(len(data) * keep) if keep > 0.1 else 3000  # 3000 bytes: inside the header's vocabulary
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(GGUFError, match="truncated") as e:
        open_model(p)
    assert str(p) in str(e.value)
    assert not _mapped(p)


def test_unknown_architecture(tmp_path):
    p = _write(tmp_path / "arch.gguf", arch="mamba9000")
    with pytest.raises(GGUFError, match="unknown architecture 'mamba9000'") as e:
        open_model(p)
    assert str(p) in str(e.value)
    assert not _mapped(p)


def test_unsupported_tensor_type(tmp_path):
    # IQ2_XXS: 256 values in 66 bytes; valid in GGUF, not supported by our engine
    raw = np.zeros((16, 66), dtype=np.uint8)
    p = _write(tmp_path / "iq2.gguf", tensors=[("token_embd.weight", raw, GGMLQuantizationType.IQ2_XXS)])
    with pytest.raises(GGUFError, match="IQ2_XXS") as e:
        open_model(p)
    assert "token_embd.weight" in str(e.value) and str(p) in str(e.value)
    assert not _mapped(p)


def test_missing_tensor(tmp_path):
    p = _write(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="missing tensor 'output_norm.weight'"):
        open_model(p)
    assert not _mapped(p)


def test_unknown_tensor_type_id(tmp_path, smollm2_path):
    """A tensor type id no GGUF version defines (a corrupt index)."""
    f = GGUFFile(smollm2_path)
    first = next(iter(f.tensors.values()))
    f.close()
    data = bytearray(smollm2_path.read_bytes())
    name = first.name.encode()
    at = data.index(name, 24)  # the first tensor's index entry: name, n_dims, dims, type, offset
    type_pos = at + len(name) + 4 + 8 * len(first.shape)
    data[type_pos:type_pos + 4] = (9999).to_bytes(4, "little")
    p = tmp_path / "typeid.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="unknown tensor type 9999"):
        open_model(p)


def test_good_models_load(model_paths):
    for name, path in model_paths.items():
        m = open_model(path)
        assert m.spec.arch in ("llama", "gemma3")
        # weights stay in their GGUF blocks: matrices hold raw bytes, not floats
        layer0 = m.layers[0]
        assert layer0["wq"].dense is None and layer0["wq"].raw.dtype.is_floating_point is False
        m.close()
