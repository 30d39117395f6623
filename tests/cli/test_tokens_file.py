#!/usr/bin/env python3
"""--tokens-file (and heatmap's --rows-file, --cols-file): labels from a UTF-8 text file, one token
per line, for `qkv heatmap` and `qkv demo`.

A file gives the same picture as the same tokens on the command line; a token may hold spaces; CRLF
line ends and a missing last line break are read as line ends. Refusals (exit code 2, one error line
naming the option, nothing written): a blank line (named by its number), an empty file, a line that
is not UTF-8, a missing file or a directory, a count that does not fit alpha, and a file given
together with --tokens, --rows or --cols.

Run: QKV_BIN=build/release/apps/qkv /usr/bin/python3 tests/cli/test_tokens_file.py
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_harness import Suite, run_suite  # noqa: E402  (the harness sits beside this script)

THREE = np.array([[0.7, 0.25, 0.05], [0.0, 1.0, 0.0], [0.15, 0.55, 0.3]], dtype=np.float32)
TWO_BY_THREE = np.array([[0.7, 0.25, 0.05], [0.15, 0.55, 0.3]], dtype=np.float32)


class TokensFileSuite(Suite):
    timeout = 60
    env = {"NO_COLOR": "1", "COLUMNS": "100"}

    def text(self, name, content):
        with open(self.path(name), "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode("utf-8"))
        return name


def same_output(t, name, args, reference_args):
    """Both runs succeed and print the same text."""
    t.count += 1
    first, second = t.run(args), t.run(reference_args)
    if first.returncode != 0 or second.returncode != 0:
        return t.fail(name, f"exit codes {first.returncode}, {second.returncode}, expected 0, 0", first)
    if first.stdout != second.stdout:
        return t.fail(name, f"{first.stdout!r} differs from {second.stdout!r}", first)
    print(f"ok   {name}")


def checks(t):
    alpha = t.save("three.npy", THREE)
    rect = t.save("two_by_three.npy", TWO_BY_THREE)
    t.text("tokens.txt", "the\ncat\nsat\n")
    t.text("crlf.txt", "the\r\ncat\r\nsat")
    t.text("rows.txt", "我\n阅读\n")
    t.text("cols.txt", "a b\nc\nd\n")
    t.text("spaces.txt", "New York\nis\nbig\n")
    t.text("blank.txt", "the\n\nsat\n")
    t.text("white.txt", "the\ncat\n \t\n")
    t.text("empty.txt", "")
    t.text("latin1.txt", b"the\ncaf\xe9\nsat\n")
    t.text("short.txt", "the\ncat\n")
    os.mkdir(t.path("folder"))

    same_output(t, "heatmap: a file gives what --tokens gives", ["heatmap", alpha, "--tokens-file", "tokens.txt"],
                ["heatmap", alpha, "--tokens", "the cat sat"])
    same_output(t, "heatmap: CRLF and no last line break", ["heatmap", alpha, "--tokens-file", "crlf.txt"],
                ["heatmap", alpha, "--tokens", "the cat sat"])
    t.succeed("heatmap: a token with a space in it", ["heatmap", alpha, "--tokens-file", "spaces.txt"],
              lambda r: None if "New York" in r.stdout else "the label 'New York' is not drawn")
    t.succeed("heatmap: --rows-file and --cols-file", ["heatmap", rect, "--rows-file", "rows.txt", "--cols-file",
                                                       "cols.txt", "-o", "rect.png"],
              lambda r: None if os.path.exists(t.path("rect.png")) else "rect.png was not written")
    same_output(t, "heatmap: --rows-file beside --cols", ["heatmap", rect, "--rows-file", "rows.txt", "--cols", "x y z"],
                ["heatmap", rect, "--rows", "我 阅读", "--cols", "x y z"])
    same_output(t, "demo: a file gives what --tokens gives", ["demo", "--no-files", "--tokens-file", "tokens.txt"],
                ["demo", "--no-files", "--tokens", "the cat sat"])

    for command in (["heatmap", alpha], ["demo", "--no-files"]):
        name = command[0]
        t.refuse(f"{name}: a blank line", [*command, "--tokens-file", "blank.txt"], "--tokens-file", "blank.txt",
                 "line 2 is blank")
        t.refuse(f"{name}: a line of white space", [*command, "--tokens-file", "white.txt"], "--tokens-file",
                 "line 3 is blank")
        t.refuse(f"{name}: an empty file", [*command, "--tokens-file", "empty.txt"], "--tokens-file", "got none")
        t.refuse(f"{name}: not UTF-8", [*command, "--tokens-file", "latin1.txt"], "--tokens-file", "line 2",
                 "UTF-8")
        t.refuse(f"{name}: a missing file", [*command, "--tokens-file", "none.txt"], "--tokens-file", "none.txt")
        t.refuse(f"{name}: a directory", [*command, "--tokens-file", "folder"], "--tokens-file", "folder")
        t.refuse(f"{name}: with --tokens", [*command, "--tokens-file", "tokens.txt", "--tokens", "the cat sat"],
                 "--tokens-file", "--tokens")
    t.refuse("heatmap: too few tokens", ["heatmap", alpha, "--tokens-file", "short.txt"], "--tokens-file",
             "expected 3 tokens one per line", "got 2")
    t.refuse("heatmap: with --rows", ["heatmap", alpha, "--tokens-file", "tokens.txt", "--rows", "a b c"],
             "--tokens-file", "--rows")
    t.refuse("heatmap: --rows-file with --rows", ["heatmap", alpha, "--rows-file", "tokens.txt", "--rows", "a b c"],
             "--rows-file", "--rows")
    t.refuse("heatmap: both axes from a file, Tq != Tk", ["heatmap", rect, "--tokens-file", "tokens.txt"],
             "--tokens-file", "Tq = 2", "Tk = 3")
    t.refuse("heatmap: --cols-file of the wrong length", ["heatmap", rect, "--cols-file", "rows.txt"], "--cols-file",
             "expected 3 tokens", "got 2")
    for name, args in (("heatmap", ["heatmap", "--help"]), ("demo", ["demo", "--help"])):
        t.succeed(f"{name} --help names --tokens-file", args,
                  lambda r: None if "--tokens-file" in r.stdout else "help lacks --tokens-file")


if __name__ == "__main__":
    sys.exit(run_suite(TokensFileSuite, "qkv_tokens_file_", checks))
