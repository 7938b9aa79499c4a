"""Accounting: what checkpoints, interruptions and resumes cost; staleness; the in-region check."""
