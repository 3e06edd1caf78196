"""The progress window of the first-run GPU setup (app/firstrun.py): it runs the setup as a child process
and shows the steps it announces (`@@step K N title`), pip's download progress (`Progress X of Y`) and the
log, and keeps the `@@result` line's outcome."""
from __future__ import annotations

import re
from typing import Callable, Sequence

from PySide6.QtCore import QProcess, QProcessEnvironment, Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QProgressBar, QVBoxLayout


class SetupProgressDialog(QDialog):
    """Runs `command` (a `setup` child process) and shows its steps, pip's download progress and its log;
    `result_ok`/`result_message` hold the outcome once it closes (made by make_progress_dialog in
    app/firstrun.py, which passes its wording: `stopped(command, code, recent)` says what happened when the
    process ends without a result line, quoting its last `tail_lines` output lines)."""

    def __init__(self, command: Sequence[str], title: str, stopped: Callable[[Sequence[str], int, Sequence[str]], str],
                 tail_lines: int):
        super().__init__()
        self._stopped, self._tail_lines = stopped, tail_lines
        self.setAttribute(Qt.WA_DeleteOnClose, False)
        self.setWindowTitle(f"HiveJet - {title}")
        self.setMinimumWidth(560)
        v = QVBoxLayout(self)
        self.step_label = QLabel("Starting…")
        self.step_label.setWordWrap(True)
        self.bar = QProgressBar()
        self.bar.setRange(0, 0)
        self.detail = QLabel("")
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(2000)
        self.log.setMinimumHeight(140)
        self.buttons = QDialogButtonBox(QDialogButtonBox.Cancel)
        self.buttons.rejected.connect(self._cancel)
        for w in (self.step_label, self.bar, self.detail, self.log, self.buttons):
            v.addWidget(w)
        self.result_ok = False
        self.result_message = ""
        self.recent: list[str] = []     # the last output lines: quoted when the setup stops without a result
        self.step = (0, 1)
        self._buf = ""
        self.proc = QProcess(self)
        self.proc.setProcessChannelMode(QProcess.MergedChannels)
        self.proc.readyReadStandardOutput.connect(self._read)
        self.proc.finished.connect(self._finished)
        self.proc.errorOccurred.connect(self._error)
        self._command = list(command)
        self._finished_called = False

    def start(self):
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        self.proc.setProcessEnvironment(env)
        self.proc.start(self._command[0], self._command[1:])

    def _read(self):
        self._buf += bytes(self.proc.readAllStandardOutput()).decode("utf-8", "replace")
        *lines, self._buf = re.split(r"\r?\n|\r", self._buf)
        for line in lines:
            self.handle_line(line)

    def handle_line(self, line: str):
        if line.startswith("@@step "):
            k, n, text = (line[7:].split(" ", 2) + [""])[:3]
            self.step = (int(k), int(n))
            self.step_label.setText(f"Step {k} of {n}: {text}")
            self.bar.setRange(0, 0)
            self.detail.setText("")
        elif line.startswith("@@result "):
            status, _, msg = line[9:].partition(" ")
            self.result_ok = status == "ok"
            self.result_message = msg.replace("\\n", "\n")
        else:
            m = re.match(r"Progress (\d+) of (\d+)", line)
            if m and int(m.group(2)) > 0:
                cur, tot = int(m.group(1)), int(m.group(2))
                self.bar.setRange(0, 1000)
                self.bar.setValue(int(1000 * cur / tot))
                self.detail.setText(f"{cur / 1e6:,.0f} MB of {tot / 1e6:,.0f} MB")
                return
            if line.strip():
                self.log.appendPlainText(line)
                self.recent = (self.recent + [line])[-self._tail_lines:]

    def _finished(self, code, _status=None):
        if self._finished_called:
            return
        self._finished_called = True
        if self._buf:
            self.handle_line(self._buf)
            self._buf = ""
        if not self.result_message:
            self.result_ok = False
            self.result_message = self._stopped(self._command, code, self.recent)
        self.accept() if self.result_ok else self.reject()

    def _error(self, err):
        if err == QProcess.FailedToStart:
            self.result_message = f"Could not start the setup ({self._command[0]})."
            self._finished(127)

    def _cancel(self):
        if self.proc.state() != QProcess.NotRunning:
            self.proc.kill()
            self.proc.waitForFinished(3000)
        self.result_ok = False
        self.result_message = "GPU setup cancelled: HiveJet runs in CPU mode for now."
        self._finished_called = True
        self.reject()
