"""Launchers that start several processes: ``ppspec serve`` (the stages and the router on
one machine) and ``ppspec demo`` (serve the demo model and send it a few prompts).

The one place that may import both ``ppspec.router`` and ``ppspec.stage_server``; those
two never import each other's modules at their top (the router reaches stages through
``router.pipeline.Pipeline``; only ``InProcessPipeline.build`` makes stage runners).
"""
