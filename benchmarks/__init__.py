"""Side-by-side measurements against torch.distributed.pipelining (not part of the test suite)."""
