#!/usr/bin/env python3
"""Drives `mlxcel run MODEL` through a pseudo-terminal, like a person at a keyboard.

    repl_pty.py MLXCEL MODEL LINE [LINE ...]

Sends each LINE after the `>>> ` prompt appears, then `/exit`. `REPL_ARGS` holds the flags after
`run MODEL --temp 0` (default `-n 200`). A LINE starting with `!ctrlc:` sends
the rest, waits until the answer has started and presses Ctrl-C (a fixed wait raced the answer's
end on a fast machine). Prints a JSON list with the terminal output that followed each line. Exits 2
on timeout.
"""
import fcntl
import json
import os
import pty
import select
import struct
import sys
import termios
import time


def main():
    exe, model, lines = sys.argv[1], sys.argv[2], sys.argv[3:]
    pid, fd = pty.fork()
    if pid == 0:
        # A wide terminal: a long line does not wrap, so the line editor echoes it without redrawing
        # the prompt (whose text marks the end of an answer here).
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 4000, 0, 0))
        extra = os.environ.get("REPL_ARGS", "-n 200").split()
        os.execv(exe, [exe, "run", model, "--temp", "0"] + extra)
    buf = b""

    def read_some(wait):
        # Whatever the terminal has within `wait` seconds into `buf`; False once it is closed.
        nonlocal buf
        if not select.select([fd], [], [], wait)[0]:
            return True
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return False
        buf += chunk
        return bool(chunk)

    def wait_while(pending, what, timeout=120):
        # Reads until `pending()` is false or the terminal closes; exits 2 past `timeout`.
        end = time.time() + timeout
        while pending():
            if time.time() > end:
                sys.stderr.write("timeout waiting for %s; got %r\n" % (what, buf[-500:]))
                sys.exit(2)
            if not read_some(0.05):
                return

    def read_until(marker):
        nonlocal buf
        wait_while(lambda: marker not in buf, repr(marker))
        i = buf.index(marker) + len(marker)
        out, buf = buf[:i], buf[i:]
        return out.decode("utf-8", "replace")

    def wait_for_answer(line):
        # The echo of the line, then some of the answer: its first bytes past the echo.
        wait_while(
            lambda: line not in buf or len(buf) - (buf.rindex(line) + len(line)) < 24,
            "an answer to %r" % line,
        )

    def send(data):
        # In pieces, reading the echo between them: a long line's echo would otherwise fill the
        # terminal's buffer while this side only writes, and both sides would wait.
        for i in range(0, len(data), 64):
            os.write(fd, data[i : i + 64])
            if i + 64 >= len(data):
                return  # the answer that follows is read_until's
            while select.select([fd], [], [], 0.05)[0]:
                if not read_some(0):
                    return

    read_until(b">>> ")
    transcripts = []
    for line in lines:
        if line.startswith("!ctrlc:"):
            text = line[len("!ctrlc:"):].encode()
            send(text + b"\r")
            wait_for_answer(text)
            os.write(fd, b"\x03")
        else:
            send(line.encode() + b"\r")
        transcripts.append(read_until(b">>> "))
    os.write(fd, b"/exit\r")
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"turns": transcripts, "exit": os.waitstatus_to_exitcode(status)}))


if __name__ == "__main__":
    main()
