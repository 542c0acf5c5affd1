"""docs/deployment.md lists every field of the tenant plan (`Quotas`) with its default, so that an
operator reads every bound a tenant is held to; the README points there."""

from pathlib import Path

import pytest

from marlaas.api.tenancy import Quotas

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_every_field_of_the_plan_is_in_the_deployment_docs():
    doc = (ROOT / "docs" / "deployment.md").read_text()
    table = doc[doc.index("### The tenant plan"):].split("\n### ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `")}
    assert set(rows) == set(Quotas.model_fields)
    for name, field in Quotas.model_fields.items():
        default = field.default
        shown = rows[name].split("|")[2].strip()
        if name == "storage_bytes":
            assert shown == f"{default >> 30} GiB"
        elif name == "max_dataset_bytes":
            assert shown == f"{default >> 20} MiB"
        else:
            assert shown.removesuffix(" s").replace(",", "") in (str(default), str(int(default))), (name, shown)
    assert "The tenant plan" in (ROOT / "README.md").read_text()
