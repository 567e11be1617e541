"""Wire types and sockets shared by every process. Nothing else imports zmq."""
