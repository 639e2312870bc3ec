-- Cache key and route for an mm-encoder cache tier or router (access phase).
--
-- key   = X-Cache-Key when present (set by the frontend or an outer tier), else sha256 of the
--         request body, read from memory or, when nginx spooled it to a file, from that file.
--         sha256 rather than md5: tiers are shared across tenants, and md5 collisions can be
--         made to order (two uploads, one hash), which would let one upload poison another's entry.
-- format: "json" when the client accepts only the legacy JSON form, else "v1": part of the
--         cache key, so one entry never answers for the other representation.
-- route : X-Cache-Route (e.g. "cluster,shared", "cluster,direct") names the levels to visit.
--         A tier caches only if it is named; it forwards to its next level if a later level is
--         named, else straight to the encoders.
-- Inputs (nginx variables set by the config): $mm_tier, $mm_drop_client_key.
-- Outputs: $cache_key, $cache_fmt, $cache_skip, $mm_upstream; X-Cache-Key is forwarded so inner
-- levels never hash again; X-Cache-Key-From names the level that hashed the body.

local tier = ngx.var.mm_tier
local key = ngx.var.http_x_cache_key
if ngx.var.mm_drop_client_key == "1" then
    key = nil
end

if key ~= nil and key ~= "" then
    if #key > 128 or not key:match("^[%w%._:%-]+$") then
        ngx.status = 400
        ngx.header["Content-Type"] = "application/json"
        ngx.say('{"error": {"code": "bad_cache_key", "message": "X-Cache-Key must be 1-128 characters of ',
                '[A-Za-z0-9._:-]"}}')
        return ngx.exit(400)
    end
else
    ngx.req.read_body()
    local sha = require("nginx.sha256"):new()
    local data = ngx.req.get_body_data()
    if data then
        sha:update(data)
    else
        local path = ngx.req.get_body_file()
        if path then
            local f, err = io.open(path, "rb")
            if not f then
                ngx.log(ngx.ERR, "cannot read spooled request body ", path, ": ", err)
                return ngx.exit(500)
            end
            while true do
                local chunk = f:read(1048576)
                if not chunk then break end
                sha:update(chunk)
            end
            f:close()
        end
    end
    key = require("nginx.string").to_hex(sha:final())
    ngx.req.set_header("X-Cache-Key-From", tier)
end
ngx.var.cache_key = key
ngx.req.set_header("X-Cache-Key", key)

local accept = ngx.var.http_accept or ""
if accept:find("application/json", 1, true) and not accept:find("vnd.mm-encoder", 1, true) then
    ngx.var.cache_fmt = "json"
else
    ngx.var.cache_fmt = "v1"
end

if tier == "router" then
    return
end
local order = { cluster = 1, shared = 2 }
local route = ngx.var.http_x_cache_route
local named, later = true, (tier == "cluster")
if route ~= nil and route ~= "" then
    named, later = false, false
    for level in route:gmatch("[^,%s]+") do
        level = level:lower()
        if level == tier then
            named = true
        elseif order[level] ~= nil and order[level] > order[tier] then
            later = true
        end
    end
end
ngx.var.cache_skip = named and "" or "1"
ngx.var.mm_upstream = later and "mm_next" or "mm_direct"
