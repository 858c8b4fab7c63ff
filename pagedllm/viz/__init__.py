"""The live visualizer: KV block events from the real engine, a replayable trace, and /viz."""
