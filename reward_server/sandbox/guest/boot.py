"""Launch one untrusted program: compile it first so a syntax error is told apart.

Usage: python3 -I boot.py MAIN.py. Exit code 97 means the program did not
compile (the agent maps it to ``compile_error``); anything else is the
program's own exit status.
"""

import sys
import traceback
import types

COMPILE_ERROR_EXIT = 97


def main() -> None:
    path = sys.argv[1]
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        code = compile(source, path, "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
        # ValueError: NUL bytes; the others: pathological sources the parser refuses.
        traceback.print_exc(limit=0)
        sys.stderr.flush()
        sys.exit(COMPILE_ERROR_EXIT)
    sys.argv = [path]
    # A fresh __main__ module: the program sees neither the launcher's globals nor its name.
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
