"""The child process of `datasets_io.check_upload`: limits itself, then reads one uploaded file as a
stream. A request {"path", "kind", "max_bytes", "memory_mb"} on stdin; {"rows", "bytes"} or {"error":
one line, "too_large": bool} on stdout. Run as `python -m marlaas.api._file_check`; never imported
by the service.
"""

from __future__ import annotations

import json
import resource
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    memory = req["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from marlaas.api import datasets_io
    from marlaas.errors import SpecError, TooLarge, one_line

    try:
        out = datasets_io.measure(req["path"], req["kind"], req["max_bytes"])
    except TooLarge as e:
        out = {"error": one_line(e), "too_large": True}
    except SpecError as e:
        out = {"error": one_line(e), "too_large": False}
    except MemoryError:
        out = {"error": f"the file needs more than {req['memory_mb']} MB to read", "too_large": True}
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
