"""One process per run, forked by the launcher process: it forks the ranks,
streams and logs their output, stops them, and (node 0) hosts the rendezvous."""
