"""Workers as Ray actors: ``connect`` joins a cluster, ``pool`` starts, feeds, replaces and stops the actors,
``actor`` is an actor's side, and ``link`` is each actor's direct TCP connection to the loader (its tasks, answers
and streamed batches). Ray is imported only when a loader asks for Ray workers."""
