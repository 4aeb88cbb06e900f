"""The control process: the usage ledger's writer, the retention purge, chain-head exports."""
