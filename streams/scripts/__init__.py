"""The worker's Redis scripts: one .lua file and one contract module each."""
