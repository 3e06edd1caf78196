"""Hugging Face Hub: search GGUF repos, list their files, download with pause / resume / cancel.

Search and file listing go through huggingface_hub (`HfApi.list_models(filter="gguf")`,
`HfApi.list_repo_tree`), which gives each file's size and, for LFS files, its sha256. Downloads use
the hub's plain `resolve` URL (`huggingface_hub.hf_hub_url`) with HTTP Range requests of our own,
because the app needs what `hf_hub_download` does not offer: pause, cancel, a progress callback with
speed and ETA, and resume after the app restarts.

Where files go: ``models_dir()/<owner>--<repo>/<file>``. While downloading, the bytes are in
``<file>.part`` and a sidecar ``<file>.part.json`` records the repo, file, revision, expected size and
sha256; `DownloadManager.restore()` finds these after a restart and lists them as paused.

Checks: free disk space before starting (and resuming); the sha256 when the hub lists one (computed
while the bytes arrive, so verification costs no second read); a network error mid-download keeps the
`.part` file and leaves the download 'failed' with a message and Resume available.

The endpoint is HF_ENDPOINT (read when a client is made), else https://huggingface.co. HF_HUB_OFFLINE=1
or an unreachable hub gives a HubError with a message; the local library keeps working.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

DEFAULT_ENDPOINT = "https://huggingface.co"
DISK_MARGIN = 256 << 20   # keep this much free beyond the file
CHUNK = 1 << 20

_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[0-9])?(?:_K)?(?:_[SMLX]{1,2})?|IQ[1-4]_(?:XXS|XS|S|M|NL)|TQ[12]_0|MXFP4(?:_MOE)?|"
    r"BF16|F16|F32|FP16|FP32)(?![A-Za-z0-9])", re.I)
_PART_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)


class HubError(RuntimeError):
    """Search or listing failed (offline, unreachable, unknown repo); the message is for the user."""


def quant_of(filename: str) -> str:
    """The quantization named in a GGUF file name: 'Qwen3-8B-Q4_K_M.gguf' -> 'Q4_K_M'."""
    stem = Path(filename).name
    stem = _PART_RE.sub(".gguf", stem)
    found = _QUANT_RE.findall(stem.replace(".", "-"))
    return found[-1].upper() if found else ""


def kind_of(filename: str) -> str:
    """'mmproj' (vision projector), 'drafter' (a draft model for speculative decoding) or 'model'."""
    n = Path(filename).name.lower()
    if "mmproj" in n:
        return "mmproj"
    if any(w in n for w in ("draft", "dflash", "eagle")):
        return "drafter"
    return "model"


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def repo_dir_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


@dataclass
class RepoHit:
    id: str
    downloads: int = 0
    likes: int = 0
    updated: str = ""


@dataclass
class HubFile:
    repo_id: str
    path: str
    size: int
    sha256: str | None
    quant: str
    kind: str
    part: tuple[int, int] | None = None   # (index, count) of a split GGUF


class HubClient:
    def __init__(self, endpoint_url: str | None = None, token: str | None = None, timeout: float = 15.0):
        self.endpoint = (endpoint_url or endpoint()).rstrip("/")
        self.token = token or os.environ.get("HF_TOKEN") or None
        self.timeout = timeout

    def _api(self):
        from huggingface_hub import HfApi
        return HfApi(endpoint=self.endpoint, token=self.token or False)

    def _wrap(self, fn, what: str):
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            raise HubError("offline mode (HF_HUB_OFFLINE is set): only models on disk are available")
        self._probe(what)
        try:
            return fn()
        except HubError:
            raise
        except Exception as e:  # httpx errors, HfHubHTTPError, RepositoryNotFoundError ...
            name = type(e).__name__
            msg = str(e).splitlines()[0] if str(e) else name
            if "RepositoryNotFound" in name or "404" in msg:
                raise HubError(f"{what}: not found on {self.endpoint}") from None
            if any(w in name for w in ("Connect", "Timeout", "Network", "Offline")) or "connect" in msg.lower():
                raise HubError(f"{what}: cannot reach {self.endpoint} (offline?). Models on disk still work.") from None
            raise HubError(f"{what}: {msg}") from None

    def _probe(self, what: str) -> None:
        """Fail fast when the hub cannot be reached at all (huggingface_hub would retry for ~25 s)."""
        import socket
        from urllib.parse import urlparse
        u = urlparse(self.endpoint)
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            socket.create_connection((u.hostname, port), timeout=min(self.timeout, 5)).close()
        except OSError as e:
            raise HubError(f"{what}: cannot reach {self.endpoint} ({e.strerror or e}; offline?). "
                           "Models on disk still work.") from None

    def search(self, query: str, limit: int = 30) -> list[RepoHit]:
        def go():
            out = []
            for m in self._api().list_models(search=query or None, filter="gguf", limit=limit, sort="downloads"):
                lm = getattr(m, "last_modified", None)
                out.append(RepoHit(m.id, int(getattr(m, "downloads", 0) or 0), int(getattr(m, "likes", 0) or 0),
                                   lm.strftime("%Y-%m-%d") if lm else ""))
            return out
        return self._wrap(go, f"search {query!r}")

    def files(self, repo_id: str, revision: str = "main") -> list[HubFile]:
        def go():
            from huggingface_hub.hf_api import RepoFile
            out = []
            for e in self._api().list_repo_tree(repo_id, recursive=True, revision=revision):
                if not isinstance(e, RepoFile) or not e.path.lower().endswith(".gguf"):
                    continue
                sha = e.lfs.sha256 if e.lfs is not None else None
                m = _PART_RE.search(e.path)
                part = (int(m.group(1)), int(m.group(2))) if m else None
                out.append(HubFile(repo_id, e.path, int(e.size), sha, quant_of(e.path), kind_of(e.path), part))
            out.sort(key=lambda f: (f.kind != "model", f.path))
            return out
        return self._wrap(go, f"list files of {repo_id}")

    def url(self, repo_id: str, filename: str, revision: str = "main") -> str:
        from huggingface_hub import hf_hub_url
        return hf_hub_url(repo_id, filename, revision=revision, endpoint=self.endpoint)


# ----------------------------------------------------------------------------------------------
# downloads

STATES = ("queued", "downloading", "paused", "verifying", "done", "failed", "cancelled")


@dataclass
class Download:
    repo_id: str
    filename: str
    dest: Path                       # final path
    size: int = 0                    # expected bytes (0 = unknown until the server says)
    sha256: str | None = None
    revision: str = "main"
    url: str = ""
    state: str = "queued"
    done_bytes: int = 0
    speed: float = 0.0               # bytes/s over the last few seconds
    error: str = ""
    token: str | None = field(default=None, repr=False)
    _stop: str = field(default="", repr=False)         # "", "pause", "cancel"
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def part(self) -> Path:
        return self.dest.with_name(self.dest.name + ".part")

    @property
    def sidecar(self) -> Path:
        return self.dest.with_name(self.dest.name + ".part.json")

    @property
    def eta(self) -> float | None:
        if self.speed <= 0 or not self.size:
            return None
        return max(self.size - self.done_bytes, 0) / self.speed

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.size if self.size else 0.0

    @property
    def active(self) -> bool:
        return self.state in ("queued", "downloading", "verifying")

    def key(self) -> str:
        return f"{self.repo_id}/{self.filename}"

    def save_sidecar(self) -> None:
        self.sidecar.write_text(json.dumps(dict(repo_id=self.repo_id, filename=self.filename, size=self.size,
                                                sha256=self.sha256, revision=self.revision, url=self.url)))


def fmt_rate(bps: float) -> str:
    for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.1f} {unit}"
    return f"{bps:.0f} B/s"


def fmt_eta(s: float | None) -> str:
    if s is None:
        return "--"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def _human(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


class DownloadManager:
    """Runs downloads in background threads. `on_change(download)` is called (from the download's
    thread) whenever its state or progress changes; the GUI turns that into a Qt signal."""

    def __init__(self, models_root: Path | None = None, client: HubClient | None = None,
                 on_change: Callable[[Download], None] | None = None):
        from engine.catalog import models_dir
        self.root = Path(models_root) if models_root else models_dir()
        self.client = client or HubClient()
        self.on_change = on_change or (lambda d: None)
        self.downloads: dict[str, Download] = {}
        self._lock = threading.Lock()

    # ----- bookkeeping -----
    def dest_for(self, repo_id: str, filename: str) -> Path:
        return self.root / repo_dir_name(repo_id) / Path(filename).name

    def restore(self) -> list[Download]:
        """Find half-finished downloads (sidecars) left by an earlier run; list them as paused."""
        found = []
        for sc in self.root.rglob("*.gguf.part.json"):
            try:
                info = json.loads(sc.read_text())
                dest = sc.with_name(sc.name[:-len(".part.json")])
                d = Download(info["repo_id"], info["filename"], dest, int(info.get("size") or 0),
                             info.get("sha256"), info.get("revision", "main"), info.get("url", ""), state="paused")
                d.done_bytes = d.part.stat().st_size if d.part.exists() else 0
            except (OSError, ValueError, KeyError):
                continue
            if d.key() not in self.downloads:
                self.downloads[d.key()] = d
                found.append(d)
        return found

    def start(self, f: HubFile, revision: str = "main") -> Download:
        key = f"{f.repo_id}/{f.path}"
        with self._lock:
            d = self.downloads.get(key)
            if d is not None and d.active:
                return d
            if d is None or d.state in ("done", "cancelled"):
                d = Download(f.repo_id, f.path, self.dest_for(f.repo_id, f.path), f.size, f.sha256, revision,
                             self.client.url(f.repo_id, f.path, revision), token=self.client.token)
                self.downloads[key] = d
        self._launch(d)
        return d

    def resume(self, d: Download) -> None:
        if d.active:
            return
        if not d.url:
            d.url = self.client.url(d.repo_id, d.filename, d.revision)
        d.token = d.token or self.client.token
        self._launch(d)

    def pause(self, d: Download) -> None:
        if d.active:
            d._stop = "pause"

    def cancel(self, d: Download) -> None:
        if d.active:
            d._stop = "cancel"
        else:
            self._discard(d)
            d.state = "cancelled"
            self.on_change(d)

    def wait(self, d: Download, timeout: float = 30) -> None:
        t = d._thread
        if t is not None:
            t.join(timeout)

    def remove(self, d: Download) -> None:
        self.downloads.pop(d.key(), None)

    @staticmethod
    def _discard(d: Download) -> None:
        for p in (d.part, d.sidecar):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def _launch(self, d: Download) -> None:
        d._stop = ""
        d.error = ""
        d.state = "queued"
        d.speed = 0.0
        self.on_change(d)
        d._thread = threading.Thread(target=self._run, args=(d,), name=f"download {d.filename}", daemon=True)
        d._thread.start()

    # ----- the download thread -----
    def _fail(self, d: Download, msg: str) -> None:
        d.state = "failed"
        d.error = msg
        d.speed = 0.0
        self.on_change(d)

    def _run(self, d: Download) -> None:
        try:
            self._download(d)
        except Exception as e:  # never let a thread die silently
            self._fail(d, f"{type(e).__name__}: {e}")

    def _download(self, d: Download) -> None:
        have = self._resume_point(d)
        if have is None:
            return
        sha = hashlib.sha256() if d.sha256 else None
        if sha and have:
            with open(d.part, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    sha.update(block)
        d.state = "downloading"
        d.done_bytes = have
        self.on_change(d)
        ok, resp = self._request(d, have)
        if not ok:
            return
        if resp is not None:
            with resp:
                if have and resp.status != 206:   # the server ignored Range: start over
                    have = 0
                    d.done_bytes = 0
                    if sha:
                        sha = hashlib.sha256()
                length = resp.headers.get("Content-Length")
                if not d.size and length is not None:
                    d.size = have + int(length)
                    d.save_sidecar()
                if not self._receive(d, resp, "ab" if have else "wb", sha):
                    return
        self._finish(d, sha)

    def _resume_point(self, d: Download) -> int | None:
        """The bytes of d.part to keep (0 when it is longer than the file), or None when the disk has no
        room for the rest (the download has then failed)."""
        d.dest.parent.mkdir(parents=True, exist_ok=True)
        have = d.part.stat().st_size if d.part.exists() else 0
        if d.size and have > d.size:
            self._discard(d)
            have = 0
        need = max(d.size - have, 0)
        free = shutil.disk_usage(d.dest.parent).free
        if need + DISK_MARGIN > free:
            self._fail(d, f"Not enough disk space in {d.dest.parent}: {_human(need)} still to download, "
                          f"only {_human(free)} free. Free some space or choose another models folder.")
            return None
        d.save_sidecar()
        return have

    def _request(self, d: Download, have: int):
        """(ok, response) for the bytes from `have` on: response None when the file is already complete
        (HTTP 416 with all bytes here); ok False when the request failed (the download has then failed)."""
        headers = {"User-Agent": "hivejet", "Accept-Encoding": "identity"}
        if d.token:
            headers["Authorization"] = f"Bearer {d.token}"
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            return True, urllib.request.urlopen(urllib.request.Request(d.url, headers=headers), timeout=20)
        except urllib.error.HTTPError as e:
            if e.code == 416 and d.size and have == d.size:
                return True, None
            self._fail(d, f"The hub answered HTTP {e.code} for {d.filename}"
                          + (" (sign-in token needed?)" if e.code in (401, 403) else ""))
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            self._fail(d, f"Network error: {reason}. {_human(have)} kept; press Resume to continue.")
        return False, None

    def _receive(self, d: Download, resp, mode: str, sha) -> bool:
        """Append the response body to d.part (hashing it, measuring the speed over the last 3 s) until it
        ends or the download is paused or cancelled; False when it failed."""
        window: list[tuple[float, int]] = [(time.monotonic(), d.done_bytes)]
        last_emit = 0.0
        try:
            with open(d.part, mode) as out:
                while True:
                    if d._stop:
                        break
                    block = resp.read(64 * 1024)
                    if not block:
                        break
                    out.write(block)
                    if sha:
                        sha.update(block)
                    d.done_bytes += len(block)
                    now = time.monotonic()
                    window.append((now, d.done_bytes))
                    while len(window) > 2 and now - window[0][0] > 3.0:
                        window.pop(0)
                    span = now - window[0][0]
                    if span > 0.05:
                        d.speed = (d.done_bytes - window[0][1]) / span
                    if now - last_emit > 0.2:
                        last_emit = now
                        self.on_change(d)
        except OSError as e:
            if isinstance(e, (ConnectionError, TimeoutError)) or "timed out" in str(e):
                self._fail(d, f"Network lost after {_human(d.done_bytes)} of {_human(d.size)}; "
                              "press Resume to continue.")
            else:
                self._fail(d, f"Cannot write {d.part}: {e.strerror or e}")
            return False
        except Exception as e:  # http.client.IncompleteRead and friends
            self._fail(d, f"Network lost after {_human(d.done_bytes)} of {_human(d.size)} "
                          f"({type(e).__name__}); press Resume to continue.")
            return False
        return True

    def _finish(self, d: Download, sha) -> None:
        """After the transfer: cancelled, paused, short, damaged (checksum) or done (d.part renamed)."""
        if d._stop == "cancel":
            self._discard(d)
            d.state, d.speed, d.done_bytes = "cancelled", 0.0, 0
            self.on_change(d)
            return
        if d._stop == "pause":
            d.state, d.speed = "paused", 0.0
            self.on_change(d)
            return
        if d.size and d.done_bytes < d.size:
            self._fail(d, f"Network lost after {_human(d.done_bytes)} of {_human(d.size)}; press Resume to continue.")
            return
        d.state = "verifying"
        self.on_change(d)
        if sha is not None and sha.hexdigest() != d.sha256:
            self._discard(d)
            self._fail(d, f"Checksum mismatch for {d.filename}: the file is damaged and was deleted. Try again.")
            return
        os.replace(d.part, d.dest)
        try:
            d.sidecar.unlink()
        except FileNotFoundError:
            pass
        d.state, d.speed = "done", 0.0
        self.on_change(d)


# ----------------------------------------------------------------------------------------------
# the local library

@dataclass
class LocalModel:
    path: Path
    name: str
    kind: str
    size: int
    quant: str
    arch: str = ""
    context_length: int = 0
    error: str = ""
    mmproj: Path | None = None
    drafter: Path | None = None


def scan_library(root: Path) -> list[LocalModel]:
    """Every finished .gguf under root (recursively), with header facts; a broken file is listed with
    its error. mmproj and drafter files are paired with the models in the same folder."""
    from engine.gguf.reader import GGUFError, GGUFFile
    from engine.planner import file_type_name
    out = []
    for p in sorted(root.rglob("*.gguf")):
        if not p.is_file():
            continue
        m = LocalModel(p, p.stem, kind_of(p.name), p.stat().st_size, quant_of(p.name))
        try:
            f = GGUFFile(p)
            try:
                md = f.metadata
                m.arch = str(md.get("general.architecture", ""))
                m.name = str(md.get("general.name") or p.stem)
                m.context_length = int(md.get(f"{m.arch}.context_length", 0) or 0)
                if m.arch == "clip":
                    m.kind = "mmproj"
                m.quant = m.quant or file_type_name(md)
            finally:
                f.close()
        except GGUFError as e:
            m.error = e.problem
        out.append(m)
    by_dir: dict[Path, list[LocalModel]] = {}
    for m in out:
        by_dir.setdefault(m.path.parent, []).append(m)
    for group in by_dir.values():
        projs = [m for m in group if m.kind == "mmproj" and not m.error]
        drafts = [m for m in group if m.kind == "drafter" and not m.error]
        for m in group:
            if m.kind == "model":
                m.mmproj = projs[0].path if projs else None
                m.drafter = drafts[0].path if drafts else None
    return out
