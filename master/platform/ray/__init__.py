"""Ray platform: every node incarnation is a Ray actor that runs the node's command.

The actor (`node_actor.NodeActor`) starts the command in its own process group on the Ray node
the node's (type, rank) is pinned to (`placement`), and its `wait()` returns the exit code. A
watcher thread in the master (`platform.RayPlatform`) turns finished `wait()` calls and dead
actors into `NodeEvent`s.

Node actors outlive a master that dies when `dlrover submit --platform ray --ray-address`
supervises it: the supervisor, a Ray driver itself, starts a job anchor actor
(`job_anchor.JobAnchor`, named in a namespace of the run's own) and the master creates every
node actor through it. Those actors are named (`node-<id>`), owned by the anchor, so they share
its fate, not the master's: a restarted master finds them by name (checking the actor id in its
handle) and watches them again, and when the supervisor goes (even SIGKILLed) Ray ends the anchor
and with it every node actor. A master without an anchor owns its actors itself (they end with
it). With `--master-actor` the master itself runs in a detached Ray actor that Ray restarts
(`master_actor.MasterActor`).

Processes never outlive their actor: the command runs under a small guard process
(`python -m master.platform.lifeline_guard FD -- COMMAND...`) whose sentinel holds the read end
of a pipe whose write end only the actor holds. When the actor's process goes away for any
reason (ray.kill, a crash, its Ray node or the master's job ending), the pipe reaches
end-of-file and the sentinel SIGKILLs the whole process group.

`ray` is imported lazily (`connect.import_ray`), so these modules (and the guard) load without
it. This package imports nothing itself: Ray workers import the actor modules by name.
"""
