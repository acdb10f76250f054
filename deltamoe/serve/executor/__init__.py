"""How the runner's work reaches the devices: in this process (`uniproc`) or over tp * ep worker ranks
under torch.distributed (`multiproc`, `group`, `worker`, `sharding`, `launch`)."""
