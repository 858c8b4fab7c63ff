"""Data parallelism: engine replicas in their own processes behind one server, and the
router that picks a replica for each request (router.py needs no torch)."""
