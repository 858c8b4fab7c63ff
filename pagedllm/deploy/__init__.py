"""Deployments of the whole server over many machines (Ray Serve): a layer above server/,
as they run its app, where dp/ (one host's replicas behind one EngineClient) sits below it."""
