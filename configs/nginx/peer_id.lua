-- Whether the caller may call this tier (set_by_lua, server rewrite phase, before any cache work):
-- "1" when its verified client certificate carries exactly one spiffe:// URI subjectAltName, of
-- a graph this tier admits (arg 1: "spiffe://<trust domain>/<graph>/", space-separated: its own graph,
-- and an encoder site's router its model clusters') and of a role this tier admits (arg 2: the roles,
-- space-separated); "0" otherwise. The subject's OU is never read: any certificate
-- request can set it. nginx has no variable for a certificate's URIs, so the DER is walked here;
-- it has been verified against the deployment's CA already, so it is well formed.
-- An admitted caller of role cache-cluster also names the calling cluster: its URI's graph goes to
-- $mm_peer_graph (declared with `set` before this runs; cluster.conf reads it), whatever header it sends.

if ngx.var.ssl_client_verify ~= "SUCCESS" then
    return "0"
end
local pem = ngx.var.ssl_client_raw_cert
if not pem then
    return "0"
end
local der = ngx.decode_base64((pem:gsub("%-%-%-%-%-[^%-]+%-%-%-%-%-", ""):gsub("%s", "")))
if not der then
    return "0"
end

-- One DER element at i: its tag, where its content starts and ends, and where the next one starts.
local function element(i, limit)
    if i + 1 > limit then return nil end
    local tag, len = der:byte(i), der:byte(i + 1)
    local start = i + 2
    if len >= 0x80 then
        local n = len - 0x80
        if n < 1 or n > 3 or start + n - 1 > limit then return nil end
        len = 0
        for k = 0, n - 1 do len = len * 256 + der:byte(start + k) end
        start = start + n
    end
    local stop = start + len - 1
    if stop > limit then return nil end
    return tag, start, stop, stop + 1
end

-- The children of the element whose content is [start, stop], as {tag, start, stop} in order.
local function children(start, stop)
    local out, i = {}, start
    while i <= stop do
        local tag, s, e, nxt = element(i, stop)
        if not tag then return nil end
        out[#out + 1] = {tag, s, e}
        i = nxt
    end
    return out
end

local function uris()
    local _, cs, ce = element(1, #der)                   -- Certificate ::= SEQUENCE
    local tbs = cs and children(cs, ce)
    if not tbs then return nil end
    local t = tbs[1]                                     -- TBSCertificate ::= SEQUENCE
    for _, f in ipairs(children(t[2], t[3]) or {}) do
        if f[1] == 0xa3 then                             -- extensions [3] EXPLICIT SEQUENCE OF Extension
            local seq = children(f[2], f[3])
            for _, ext in ipairs(seq and children(seq[1][2], seq[1][3]) or {}) do
                local parts = children(ext[2], ext[3]) or {}
                local oid = parts[1]
                if oid and oid[1] == 0x06 and der:sub(oid[2], oid[3]) == "\85\29\17" then  -- 2.5.29.17
                    local value = parts[#parts]          -- extnValue OCTET STRING (after `critical`)
                    local _, gs, ge = element(value[2], value[3])  -- GeneralNames ::= SEQUENCE
                    local found = {}
                    for _, name in ipairs(gs and children(gs, ge) or {}) do
                        if name[1] == 0x86 then          -- uniformResourceIdentifier [6] IA5String
                            found[#found + 1] = der:sub(name[2], name[3])
                        end
                    end
                    return found
                end
            end
        end
    end
    return {}
end

local found = uris()
local spiffe = {}
for _, uri in ipairs(found or {}) do
    if uri:sub(1, 9) == "spiffe://" then spiffe[#spiffe + 1] = uri end
end
if #spiffe ~= 1 then
    return "0"
end
local role
for prefix in ngx.arg[1]:gmatch("%S+") do
    if spiffe[1]:sub(1, #prefix) == prefix then
        role = spiffe[1]:sub(#prefix + 1):match("^([a-z0-9%-]+)/[a-z0-9%-]+$")
        break
    end
end
if not role then
    return "0"
end
for admitted in ngx.arg[2]:gmatch("%S+") do
    if admitted == role then
        if role == "cache-cluster" then
            local graph = spiffe[1]:match("^spiffe://[^/]+/([a-z0-9%-]+)/")
            ngx.var.mm_peer_graph = (graph and #graph <= 63) and graph or "invalid"
        end
        return "1"
    end
end
return "0"
