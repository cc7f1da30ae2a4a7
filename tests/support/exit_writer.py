"""`mashbox ...` as the CLI runs it, then what a program around it (a profiler, coverage) does
at exit: open a file, let the garbage collector run, write to it. Prints whether the write
landed: an object of mashbox's still holding a descriptor it had closed, or handed over,
would close the file's reused number under it when collected."""

import gc
import os

from mashbox import cli

if __name__ == "__main__":  # not again in the engine's spawned process
    try:
        cli.main()
    except SystemExit:
        pass
    fd = os.open(os.devnull, os.O_WRONLY)
    gc.collect()
    try:
        os.write(fd, b"x")
        print("exit writer: the write landed", flush=True)
    except OSError as e:
        print(f"exit writer: {e}", flush=True)
