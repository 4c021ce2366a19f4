"""`lmdeploy chat` on a pseudo-terminal: Ctrl-C stops a reply and keeps the conversation; readline history."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time

from chat_templates import QWEN3, QWEN3_PROMPT_ENDS
from scripted_model import save_scripted_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Terminal:
    """A child process on a pty, its controlling terminal: Ctrl-C is a SIGINT from the line discipline."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the program, with SIGINT restored (a background runner ignores it)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.output = ''

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                self.output += os.read(self.fd, 65536).decode(errors='replace')
            except OSError:  # the child closed the terminal
                time.sleep(timeout)

    def expect(self, pattern: str, timeout: float = 90.0, after: int = 0) -> re.Match:
        """The first match of `pattern` in the output from offset `after`, waiting for it."""
        deadline = time.monotonic() + timeout
        while (match := re.compile(pattern, re.S).search(self.output, after)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f'no {pattern!r} in {self.output[after:][-3000:]!r}'
            self._read(min(left, 0.5))
        return match

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def interrupt_when_reading(self, timeout: float = 30.0) -> None:
        """Ctrl-C once the child's main thread sleeps in select/poll: readline waiting for a key. CPython's readline
        checks signals only when its select() is interrupted, so a SIGINT landing between the prompt being written
        and select() being entered is not seen until the next key (on a loaded machine 22 of 100 such Ctrl-Cs were
        lost by a bare `input()`); a person pressing Ctrl-C at a prompt always finds it waiting."""
        deadline = time.monotonic() + timeout
        while not any(word in _wchan(self.pid) for word in ('poll', 'select')):
            assert time.monotonic() < deadline, f'chat never waited for a key: {self.output[-2000:]!r}'
            self._read(0.01)
        self.send('\x03')

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            self._read(0.1)
        os.kill(self.pid, 9)
        raise AssertionError(f'chat did not exit: {self.output[-2000:]!r}')


def _wchan(pid: int) -> str:
    """Where in the kernel the process's main thread sleeps (Linux: /proc/PID/wchan)."""
    with open(f'/proc/{pid}/wchan') as f:
        return f.read()


def test_ctrl_c_mid_reply_keeps_the_conversation(tmp_path):
    # a model that never stops on its own: every reply runs until Ctrl-C (or --max-new-tokens)
    model = save_scripted_model(str(tmp_path / 'looper'), ['Hello wor', 'ld! ', 'and so on, '], QWEN3,
                                QWEN3_PROMPT_ENDS, loop=True)
    env = dict(os.environ, PYTHONPATH=ROOT, HOME=str(tmp_path), OMP_NUM_THREADS='1', TERM='dumb')
    term = Terminal(['-m', 'lmdeploy.cli.entrypoint', 'chat', model, '--device', 'cpu', '--show-cached',
                     '--max-new-tokens', '3500', '--num-gpu-blocks', '512', '--cache-block-seq-len', '16'], env)
    try:
        term.expect('prefix caching turned on')
        at = term.expect('>>> ').end()
        term.interrupt_when_reading()  # Ctrl-C at the prompt: a fresh prompt, nothing sent
        at = term.expect('>>> ', after=at).end()
        term.send('First question\r')
        at = term.expect('Hello world! and so on', after=at).end()
        term.send('\x03')  # Ctrl-C mid-reply
        first = term.expect(r'\[interrupted\]\s*\[cached tokens: (\d+)/(\d+)', after=at)
        at = term.expect('>>> ', after=first.end()).end()
        term.send('Second question\r')
        at = term.expect('Hello world! and so on', after=at).end()
        term.send('\x03')
        second = term.expect(r'\[interrupted\]\s*\[cached tokens: (\d+)/(\d+)', after=at)
        term.expect('>>> ', after=second.end())
        term.send('/exit\r')
        assert term.wait() == 0
    finally:
        if term.pid:
            try:
                os.kill(term.pid, 9)
            except ProcessLookupError:
                pass
    # turn 2's prompt holds turn 1 (question + the partial reply) and the new question; the cache served turn 1
    turn1_prompt, turn2_prompt, turn2_cached = int(first.group(2)), int(second.group(2)), int(second.group(1))
    assert turn2_prompt > turn1_prompt + 4
    assert turn2_cached >= turn1_prompt // 16 * 16 > 0
    with open(tmp_path / '.lmdeploy_chat_history') as f:  # readline kept the lines
        assert [line for line in f.read().splitlines() if 'question' in line] == ['First question',
                                                                                  'Second question']
