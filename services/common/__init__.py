"""What every service shares: server bootstrap (:mod:`.server`: health, reflection, auth,
drain), bearer tokens (:mod:`.auth`), validated settings (:mod:`.config`), the client
channel and retries (:mod:`.channel`), and the error -> status table (:mod:`.status`)."""
