"""The `hivejet` command: tokenize like llama-tokenize, generation, clear errors for bad input."""
from __future__ import annotations

import subprocess
import sys

import pytest

from app import __version__
from app.cli import main
from engine.catalog import CatalogError, ensure_model


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tokenize_ids_match_llamacpp(model, model_paths, reference_dir, capsys):
    for text in ("gpl3", "unicode_mix"):
        assert main(["tokenize", "-m", str(model_paths[model]), "-f",
                     str(reference_dir / "texts" / f"{text}.txt"), "--ids"]) == 0
        out = capsys.readouterr().out.strip()
        assert out == (reference_dir / f"{model}.{text}.tokens.txt").read_text().strip()


def test_version():
    r = subprocess.run([sys.executable, "-m", "app.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout


def test_generate_greedy(smollm2_path, capsys):
    assert main(["generate", "-m", str(smollm2_path), "-p", "The capital of France is", "--temp", "0",
                 "-n", "6", "--no-echo", "--ignore-eos"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() and "[length]" in cap.err and "generated 6 tokens" in cap.err


def test_broken_model_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    for cmd in (["generate", "-p", "x"], ["tokenize", "-p", "x"], ["perplexity", "-f", str(bad)]):
        assert main([cmd[0], "-m", str(bad)] + cmd[1:]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("hivejet: error: ") and str(bad) in err and "\n" not in err


def test_bad_sampling_value(smollm2_path, capsys):
    assert main(["generate", "-m", str(smollm2_path), "-p", "x", "--top-p", "1.5"]) == 1
    assert "top_p" in capsys.readouterr().err


def test_unknown_model_name(capsys):
    assert main(["tokenize", "-m", "no-such-model", "-p", "x"]) == 1
    assert "neither a file nor a catalog model" in capsys.readouterr().err
    with pytest.raises(CatalogError):
        ensure_model("no-such-model")


def test_catalog_passes_paths_through(smollm2_path):
    assert ensure_model(str(smollm2_path)) == smollm2_path
    assert ensure_model("demo") == smollm2_path  # already fetched: no download


def test_terminal_chat(smollm2_path, monkeypatch, capsys):
    """`hivejet` without a GUI: a terminal chat that answers and quits on an empty line."""
    lines = iter(["Say hi.", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", str(smollm2_path), "-n", "4", "--temp", "0"]) == 0
    cap = capsys.readouterr()
    assert "chatting with" in cap.err and cap.out.strip()


def test_generate_needs_prompt_or_chat(capsys):
    assert main(["generate", "-m", "demo"]) == 1
    assert "-p TEXT, or --chat" in capsys.readouterr().err


def test_generate_chat_interactive(smollm2_path, monkeypatch, capsys):
    lines = iter(["Hi", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["generate", "-m", str(smollm2_path), "--chat", "-n", "3", "--temp", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_tokenize_file_keeps_cr_and_crlf_like_llamacpp(smollm2_path, tmp_path, capsys):
    """-f reads the file's bytes as llama.cpp does: CR and CRLF stay (no newline translation), and each byte
    that does not start a valid UTF-8 sequence is one U+FFFD (llama.cpp's unicode_cpts_from_utf8)."""
    f = tmp_path / "windows.txt"
    f.write_bytes(b"line one\r\nline two\rthree\xe2\x82 end\r\n")
    assert main(["tokenize", "-m", str(smollm2_path), "-f", str(f), "--ids"]) == 0
    from_file = capsys.readouterr().out.strip()
    assert main(["tokenize", "-m", str(smollm2_path), "-p", "line one\r\nline two\rthree\ufffd\ufffd end\r\n",
                 "--ids"]) == 0
    assert from_file == capsys.readouterr().out.strip()
    assert main(["tokenize", "-m", str(smollm2_path), "-p", "line one\nline two\nthree\ufffd\ufffd end\n",
                 "--ids"]) == 0
    assert from_file != capsys.readouterr().out.strip()


def test_perplexity_reads_file_bytes(tmp_path):
    from app.cli import read_text_file
    f = tmp_path / "crlf.txt"
    f.write_bytes(b"a\r\nb\r\xff\r\n")
    assert read_text_file(f) == "a\r\nb\r\ufffd\r\n"
    assert read_text_file(f, drop_final_newline=True) == "a\r\nb\r\ufffd\r"     # llama-perplexity's -f


def test_perplexity_file_keeps_crlf(smollm2_path, tmp_path, capsys):
    """`hivejet perplexity -f` scores the file's bytes: a CRLF file's "\r\n" tokens are scored, so it gives
    another perplexity than the same lines ending in LF (newline translation made them the same text)."""
    line = "The cat sat on the mat and looked at the door."
    reports = []
    for name, end in (("crlf.txt", b"\r\n"), ("lf.txt", b"\n")):
        f = tmp_path / name
        f.write_bytes((line.encode() + end) * 12)
        assert main(["perplexity", "-m", str(smollm2_path), "-f", str(f), "-c", "64", "--chunks", "1"]) == 0
        reports.append(capsys.readouterr().out.strip())
    assert reports[0] and reports[1] and reports[0] != reports[1], reports


def test_terminal_chat_commands_and_reply_stats(smollm2_path, monkeypatch, capsys):
    """/help lists the commands and /reset says it cleared the conversation; neither reaches the model.
    Each reply ends with its tokens, tok/s and time to first token."""
    from engine.engine import Engine
    sent = []
    submit = Engine.submit

    def spy(self, req, *a, **k):
        sent.append([m["content"] for m in req.messages])
        return submit(self, req, *a, **k)
    monkeypatch.setattr(Engine, "submit", spy)
    lines = iter(["/help", "Say hi.", "/reset", "Again", "/quit", "never sent"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", str(smollm2_path), "-n", "4", "--temp", "0", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "/reset" in err and "/help" in err and "/quit" in err and "conversation cleared" in err
    assert sent == [["Say hi."], ["Again"]]       # no command went to the model, /reset forgot the first turn
    assert err.count("4 tokens · ") == 2 and err.count(" tok/s · first token ") == 2
