"""The child process of one grader dry run (`marlaas.api.dryruns`): limits itself, then grades once.

A request {"grader", "item", "output_text", "registered", "home", "memory_mb", "cpu_s"} on stdin;
{"reward", "error", "sub_rewards"} or {"fail": one line} (the grader cannot load) on stdout. Run as
`python -m marlaas.api._dry_child`; never imported by the service.
"""

from __future__ import annotations

import json
import resource
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    memory = req["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (req["cpu_s"], req["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from marlaas.errors import GraderLoadError, MarlaasError, one_line
    from marlaas.verify import graders, sandbox

    if req.get("home"):
        sandbox.set_service_home(req["home"])
    try:
        grader = graders.parse_grader(req["grader"])
        out = graders.dry_run(grader, req["item"], req["output_text"], req["registered"])
    except GraderLoadError as e:
        out = {"fail": f"invalid grader: {one_line(e)}"}
    except MemoryError:
        out = {"reward": 0.0, "error": f"the grader needed more than {req['memory_mb']} MB", "sub_rewards": {}}
    except MarlaasError as e:
        out = {"fail": one_line(e)}
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
