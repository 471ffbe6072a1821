"""Everything that starts, hosts and talks to a scheduler: channels, the child entry point,
the thread / process / data-parallel hosts, the loop that routes typed messages, and the
tensor-parallel ranks' launch, leader and worker. ``rollout_engine.scheduler`` (the step as a
library) never imports this package."""
