"""What a request is: its body, the rules a replica applies, its price and hints."""
