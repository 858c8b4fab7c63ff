"""One file a family (or a few that share a lineage): its rows of family.Family, the only place its
name and quirks are written down. registry.py lists them by model_type."""
