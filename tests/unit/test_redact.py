"""Errors and status lines never carry the store's password."""

import pytest

from marlaas.errors import StoreUnavailable, redact_url
from marlaas.ops.embedded import free_port
from marlaas.store import Store

pytestmark = pytest.mark.unit


def test_redact_url_hides_only_the_password():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://user:s3cret@h:1/2") == "redis://user:***@h:1/2"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_store_that_does_not_answer_is_named_without_its_password():
    url = f"redis://:TopSecretPass@127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(StoreUnavailable, match=r"Redis at redis://:\*\*\*@127\.0\.0\.1:\d+/0 does not answer") as e:
        Store(url).check()
    assert "TopSecretPass" not in str(e.value)
