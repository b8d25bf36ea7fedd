"""The teacher scoring service: the servicer and ``serve_teacher`` (:mod:`.server`), the
``RemoteTeacher`` client (:mod:`.client`), dynamic batching (:mod:`.batching`) and the wire
messages (:mod:`.messages`).

Nothing is re-exported here, so importing the client does not import the server side."""
