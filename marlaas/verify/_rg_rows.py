"""The child process of `rg_guard.make_split_bounded`: limits itself, then makes one job's reasoning-gym
rows. A request {"name", "config", "seed", "n_train", "n_held", "cpu_s"} on stdin; {"train", "held"} or
{"error": one line} on stdout. Run as `python -m marlaas.verify._rg_rows`; never imported by the service.
"""

from __future__ import annotations

import json
import sys

from marlaas.errors import TaskSourceError, one_line
from marlaas.verify.rg_guard import CPU_S, DATASET_MB, MEMORY_MB


def _limit_self(cpu_s: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_MB << 20, MEMORY_MB << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    req = json.loads(sys.stdin.read())
    _limit_self(int(req.get("cpu_s", CPU_S)))
    from marlaas.verify import reasoning_gym

    reasoning_gym.registry()  # the library's own memory is not the dataset's
    before = _rss_mb()
    try:
        train, held = reasoning_gym.make_split(req["name"], req["config"], req["seed"], req["n_train"], req["n_held"])
        grown = _rss_mb() - before
        if grown > DATASET_MB:
            raise TaskSourceError(f"reasoning-gym task {req['name']!r} with this config needs {grown:.0f} MB "
                                  f"(more than {DATASET_MB} MB) to make its rows: make it smaller")
        out = {"train": train, "held": held}
    except TaskSourceError as e:
        out = {"error": str(e)}
    except MemoryError:
        out = {"error": f"reasoning-gym task {req['name']!r} with this config needs more than {MEMORY_MB} MB "
                        f"to make its rows: make it smaller"}
    except Exception as e:  # noqa: BLE001  (a generator failing on this config: the tenant's one line)
        out = {"error": f"reasoning-gym task {req['name']!r} could not make rows with this config: "
                        f"{type(e).__name__}: {one_line(e, 200)}"}
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
