"""The `llmfleet` command: process verbs, tenants and keys, models, usage; the local stack."""
