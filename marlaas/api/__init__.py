"""The tenants' side: the Python client and admission (tenancy, rows, chat template, context checks)."""
