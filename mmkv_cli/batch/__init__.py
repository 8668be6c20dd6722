"""mmkv batch: many media encoded into content-addressed packs, in-process or on Ray, with a ledger
that lets a rerun skip what is done."""
