"""`deltamoe router`: an OpenAI front for prefill and decode servers (P/D disaggregation)."""
