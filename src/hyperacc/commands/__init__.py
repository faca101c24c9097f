"""Click commands of the ``hyperacc`` CLI, one module each, loaded only when invoked."""
