"""Layer families (``stage_server.family.LayerFamily``), one module each, and the blocks they share."""
