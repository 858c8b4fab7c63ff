"""Parsers of a model's free text, chosen by name: tool calls (--tool-call-parser) and
reasoning (--reasoning-parser). They read text and know no API: nothing here imports the
server's other modules, and the CLI reads their names without loading the server."""
