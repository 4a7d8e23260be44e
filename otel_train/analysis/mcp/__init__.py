"""An MCP server over otel-train runs: the analysis as tools an agent can call (docs/mcp.md).

:func:`~.server.serve` runs it on stdio (``otel-train mcp [ROOT ...]``); :mod:`.tools` and
:mod:`.drill` hold the tools' answers as plain dicts (usable without the ``mcp`` SDK); :mod:`.roots`
keeps every path inside the roots the server was given.
"""
