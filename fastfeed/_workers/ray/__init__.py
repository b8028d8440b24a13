"""Workers as Ray actors: ``connect`` joins a cluster, ``pool`` starts, feeds, replaces and stops the actors, and
``actor`` is an actor's side. Each actor's direct TCP link to the loader (its tasks, answers and streamed batches)
is ``link`` (the loader's end), ``sender`` (the actor's end), ``sockets`` (the plumbing both share) and ``wire``
(the protocol: every byte a peer sends is read, authenticated and bounded there, the trust boundary in one file).
Ray is imported only when a loader asks for Ray workers."""
