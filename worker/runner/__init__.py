"""The model runner: the only code in llmfleet that imports torch."""
