"""Uploads are measured before they are decoded, and decoded in a memory-limited child: a parquet "bomb"
(a few KB that decode to 200 MB) is refused fast without growing the API; rows past the plan's
`max_dataset_bytes` are refused at upload, and at submit before any rendering or tokenising."""

from __future__ import annotations

import io
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marlaas.api.tenancy import Quotas, add_tenant
from tests.integration.test_api import err, serve, two  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


def _parquet(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", **kw)
    return buf.getvalue()


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _peak_growth_mb(fn) -> tuple[float, object]:
    """(largest RSS growth of this process in MB while fn runs, fn's result), sampled every 5 ms."""
    before, peak, done = _rss_kb(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kb())
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return (max(peak[0], _rss_kb()) - before) / 1024, out


BIG = pa.table({"prompt": ["a" * 1_000_000] * 200})  # 200 MB of text in one column


@pytest.mark.parametrize("dictionary", [False, True], ids=["plain", "dictionary"])
def test_a_parquet_bomb_is_refused_fast_without_growing_the_api(two, dictionary):  # noqa: F811
    _, c, _ = two
    body = _parquet(BIG, use_dictionary=dictionary)
    assert len(body) < 20_000  # a few KB on the wire
    c["alice"].post("/v1/files", content=_parquet(pa.table({"prompt": ["warm"]})),
                    params={"filename": "warm.parquet"})  # imports on both sides, once
    t = time.monotonic()
    grown, r = _peak_growth_mb(lambda: c["alice"].post("/v1/files", content=body,
                                                        params={"filename": "bomb.parquet"}, timeout=120))
    took = time.monotonic() - t
    msg = err(r, 413, "TooLarge")
    assert "max_dataset_bytes" in msg and "bomb.parquet" in msg
    # plain: the footer's uncompressed size refuses it before any data is decoded; dictionary-encoded:
    # the footer undercounts, the child's stream refuses it past the plan's bytes
    assert ("uncompressed" in msg) != dictionary, msg
    assert took < 30, took
    assert grown < 100, grown
    assert c["alice"].get("/v1/usage").status_code == 200  # the server still answers


def test_rows_past_the_plan_are_refused_at_upload_and_submit(two, st):  # noqa: F811
    url, c, _ = two
    import httpx

    token = add_tenant(st, "small", Quotas(max_dataset_bytes=2048))
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as small:
        rows = b"".join(b'{"prompt": "%d %s", "answer": "1"}\n' % (i, b"x" * 40) for i in range(60))
        msg = err(small.post("/v1/files", content=rows, params={"filename": "d.jsonl"}), 413, "TooLarge")
        assert "more than 2048 bytes as JSON" in msg and "d.jsonl line" in msg
        ok = small.post("/v1/files", content=b"".join(rows.splitlines(True)[:10]), params={"filename": "ok.jsonl"})
        assert ok.status_code == 201, ok.text
        # inline rows: the quota is applied before the chat template and the tokenizer see them
        inline = [{"prompt": f"{i} " + "y" * 60, "answer": "1"} for i in range(40)]
        msg = err(small.post("/v1/jobs", json={"dataset": inline, "steps": 1, "prompts_per_step": 1,
                                               "group_size": 2, "eval_size": 1}), 422, "SpecError")
        assert "over quota: the dataset has" in msg
    bad = b'{"prompt": "a"}\n[1, 2]\n'
    assert "expected an object" in err(c["alice"].post("/v1/files", content=bad, params={"filename": "b.jsonl"}),
                                       422, "SpecError")
    deep = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}\n"
    r = c["alice"].post("/v1/files", content=deep, params={"filename": "deep.jsonl"})
    assert r.status_code in (413, 422), r.text
