"""The trainer lane of the Celery train tasks: one context manager holds it and releases it once on
every exit; releases are token-checked, so a lease another task took since is left alone."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_trainer_lane_is_released_on_every_exit_and_only_its_own(st, monkeypatch):
    import tasks.train as tt

    monkeypatch.setattr(tt, "store", lambda: st)
    tok = st.take_trainer("j", 0, 60)
    with tt.trainer_lane(tok):
        lease = st.trainer_lease()
        assert lease["token"] == tok and lease["worker"].startswith("train@")  # this worker is named
    assert st.trainer_lease() is None

    tok = st.take_trainer("j", 1, 60)
    with pytest.raises(RuntimeError), tt.trainer_lane(tok):
        raise RuntimeError("the step failed")
    assert st.trainer_lease() is None  # freed at once: other tenants go on

    tok = st.take_trainer("j", 2, 60)
    with tt.trainer_lane(tok):
        st.release_trainer(tok)  # as the publish script does with the lease it names
        other = st.take_trainer("k", 0, 60)  # the tick gives the lane to another task
    assert st.trainer_lease()["token"] == other  # the second release did not free it
    st.release_trainer(other)
