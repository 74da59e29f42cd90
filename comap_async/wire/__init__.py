"""How processes meet: the message declarations, the codec, and the clients of the broker and of
the inference server. Every process imports these; none imports another process."""
